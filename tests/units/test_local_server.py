"""The vLLM server `forge demo --async --generation_backend vllm` starts (forge/model/local_server.py): the
cores it gets, and a server that cannot start ends the demo with one error that shows its log."""

import sys

import pytest

from forge.model.local_server import local_server, split_cores


def test_the_server_gets_the_second_half_of_the_cores_and_one_core_is_shared():
    assert split_cores([0, 1]) == ([0], [1])
    assert split_cores([0, 1, 2, 3, 4]) == ([0, 1], [2, 3, 4])
    assert split_cores([3]) == ([3], [3])


def test_a_server_that_exits_before_it_answers_is_an_error_with_its_log(tmp_path, monkeypatch):
    # a stand-in for `python -m forge vllm-serve` that says why it stops and exits, as one without vLLM does
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\necho 'forge: error: generation_backend=vllm needs vLLM'\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    log = tmp_path / "vllm_server.log"
    with pytest.raises(RuntimeError, match=r"the vLLM server \(forge vllm-serve --model default --port \d+ "
                                           r"--dtype auto\) exited with code 2 before it answered(.|\n)*needs vLLM"):
        with local_server("default", "auto", [0], log, timeout=30):
            pass  # never reached
