"""`pass_uuid`: one name for the rewrite's code and settings, the same in every process."""

from __future__ import annotations

import subprocess
import sys

from uniprefill import UniPrefillConfig
from uniprefill.passes import pass_uuid


def test_the_pass_uuid_is_the_same_in_another_process_and_changes_with_the_settings():
    here = pass_uuid(UniPrefillConfig())
    there = subprocess.run(
        [sys.executable, "-c", "from uniprefill import UniPrefillConfig; from uniprefill.passes import pass_uuid; "
         "print(pass_uuid(UniPrefillConfig()))"], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there and len(here) == 64
    assert pass_uuid(UniPrefillConfig(p=0.9)) != here
    assert pass_uuid(UniPrefillConfig(drop_layers=(3,))) != here


def test_the_pass_uuid_changes_with_the_code(monkeypatch):
    import uniprefill.passes as passes

    before = pass_uuid(UniPrefillConfig())
    monkeypatch.setattr(passes, "_SOURCES", passes._SOURCES[:-1])  # one module fewer: other code
    assert pass_uuid(UniPrefillConfig()) != before


def test_the_backend_names_its_rewrite_with_the_pass_uuid():
    from uniprefill.backend import UniPrefillBackend

    config = UniPrefillConfig(p=0.9)
    assert UniPrefillBackend(config).uuid() == pass_uuid(config)


def test_the_vllm_backend_also_names_the_vllm_rewrite_code():
    from uniprefill.vllm.plugin import VllmTokenDropBackend

    config = UniPrefillConfig()
    uuid = VllmTokenDropBackend(config).uuid()
    assert uuid == pass_uuid(config, extra_sources=("uniprefill.vllm",)) and uuid != pass_uuid(config)
