"""What an engine team meets when it calls install() where SGLang is not installed."""

from __future__ import annotations

import importlib

import pytest

import portable_kv.engines.sglang as pk_sglang


def sglang_installed() -> bool:
    # tests/sglang is on the path as a namespace package named sglang: ask for SGLang's own code.
    try:
        importlib.import_module("sglang.srt")
    except ImportError:
        return False
    return True


@pytest.mark.skipif(sglang_installed(), reason="sglang is installed here: `tox -e cpu` runs this without it")
def test_install_without_sglang_says_which_release_and_how_to_install_it():
    with pytest.raises(ImportError) as raised:
        pk_sglang.install()
    message = str(raised.value)
    assert "\n" not in message
    assert f"SGLang {pk_sglang.SGLANG_VERSION}" in message
    assert f"pip install sglang=={pk_sglang.SGLANG_VERSION}" in message
    assert raised.value.name == "sglang"
    pk_sglang.uninstall()  # nothing was installed: nothing to give back, no error
