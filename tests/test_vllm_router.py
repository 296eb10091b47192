"""`kvmesh router --backend vllm`: server specs and flag errors (no vLLM needed)."""
from __future__ import annotations

import pytest

from kvmesh.services.vllm_router import VllmServerSpec, parse_server_spec


def test_parse_server_spec_forms():
    assert parse_server_spec("a=http://h:8000/v1,tcp://h:5557") == VllmServerSpec("a", "http://h:8000",
                                                                                  "tcp://h:5557", None)
    assert parse_server_spec("http://h:8000/,tcp://h:5557,tcp://h:5558", 3) == VllmServerSpec(
        "vllm-3", "http://h:8000", "tcp://h:5557", "tcp://h:5558")


@pytest.mark.parametrize("text, word", [
    ("http://h:8000", "--vllm-server takes"),
    ("h:8000,tcp://h:1", "must start with http"),
    ("http://h:8000,h:5557", "ZMQ addresses"),
    ("a=http://h:8000,,tcp://h:1", "--vllm-server takes"),
])
def test_parse_server_spec_errors_name_the_flag(text, word):
    with pytest.raises(ValueError, match=word):
        parse_server_spec(text)


@pytest.mark.parametrize("argv, word", [
    (["--backend", "vllm", "--http-port", "1", "--vllm-block-size", "16"], "needs at least one --vllm-server"),
    (["--backend", "vllm", "--http-port", "1", "--vllm-server", "http://h:1,tcp://h:2"], "--vllm-block-size"),
    (["--backend", "vllm", "--vllm-server", "http://h:1,tcp://h:2", "--vllm-block-size", "16"], "--http-port"),
    (["--backend", "vllm", "--http-port", "1", "--vllm-server", "http://h:1,tcp://h:2", "--vllm-block-size", "16",
      "--vllm-hash-algo", "xxhash"], "PYTHONHASHSEED"),
    (["--backend", "vllm", "--http-port", "1", "--vllm-server", "http://h:1,tcp://h:2", "--vllm-block-size", "16",
      "--vllm-version", "0.8.5"], "not supported"),
    (["--port", "1"], "--redis-url"),
])
def test_router_flag_errors(argv, word, capsys):
    from kvmesh.services.cli import build_parser

    args = build_parser().parse_args(["router", *argv])
    with pytest.raises(SystemExit) as exit_:
        args.func(args)
    assert exit_.value.code == 2
    assert word in capsys.readouterr().err
