"""Per-forward runtime state: drop history."""
from .history import DropHistory, DropPoint, DropRecorder

__all__ = ["DropHistory", "DropPoint", "DropRecorder"]
