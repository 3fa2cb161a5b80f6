from .config import UniPrefillConfig
