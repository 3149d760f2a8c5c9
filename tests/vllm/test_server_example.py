"""examples/vllm_server.md's command, parsed by vLLM 0.33.0's own `vllm serve` argument parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vllm 0.33.0 is not installed here (tox -e vllm installs it)")

from vllm.entrypoints.common.cli_args import make_arg_parser  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_server.md"


def serve_command() -> list[str]:
    """The `vllm serve ...` command of the example's bash block, as a shell splits it."""
    block = re.search(r"```bash\n(.*?)```", EXAMPLE.read_text(), re.S).group(1)
    command = block[block.index("vllm serve"):].replace("\\\n", " ")
    words = shlex.split(command)
    assert words[:2] == ["vllm", "serve"]
    return words[2:]


def test_the_example_command_parses_and_names_the_spec():
    words = serve_command()
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(words)
    assert args.model_tag == "meta-llama/Meta-Llama-3-8B-Instruct" and args.block_size == 16
    config = args.kv_transfer_config
    assert (config.kv_connector, config.kv_role) == ("OffloadingConnector", "kv_both")
    extra = config.kv_connector_extra_config
    assert extra["cpu_bytes_to_use"] == 64 * 1024**3
    from portable_kv.engines.vllm import PortableKVOffloadingSpec

    assert OffloadingSpecFactory.get_spec_cls(extra) is PortableKVOffloadingSpec


def test_the_parser_refuses_a_misspelt_flag():
    words = [w.replace("--kv-transfer-config", "--kv-transfer-conf1g") for w in serve_command()]
    with pytest.raises(SystemExit):
        make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(words)
