"""A tool costs its call, never the run: results turned into text inside the call's timeout and error handling
(both isolations), and tool_isolation='process' (worker processes: killed at the timeout, memory-capped,
refusing tools another process cannot load)."""

import functools
import subprocess
import sys
import threading
import time

import pytest
from hostile_tools import (
    chatty,
    deeply_nested,
    exits,
    hog,
    huge_int,
    raises_unprintable,
    slow_to_print,
    spin,
    unprintable,
)

from forge import GRPOConfig
from forge.tools.calls import ToolCall, ToolSettings, as_tools, calculator, load_tools, run_calls
from forge.tools.worker import ToolWorkers

ISOLATIONS = ["thread", "process"]


def settings_for(isolation, *functions, **limits) -> ToolSettings:
    return ToolSettings(as_tools(list(functions)), isolation=isolation, **limits)


def call(name, **arguments) -> ToolCall:
    return ToolCall(f"<{name}>", name, arguments)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_result_that_cannot_become_text_costs_its_call(isolation):
    settings = settings_for(isolation, huge_int, unprintable, deeply_nested, calculator, timeout=20)
    results = run_calls([call("huge_int", text=""), call("unprintable", text=""), call("deeply_nested", text=""),
                         call("calculator", expression="6 * 7")], settings)
    assert [r.failure for r in results] == ["error", "error", "error", None]
    assert "4300" in results[0].output and "Exceeds the limit" in results[0].output
    assert results[1].output == "error: RuntimeError: no text for you"
    assert results[2].output.startswith("error: RecursionError")
    assert results[3].output == "42"


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_str_that_blocks_is_under_the_call_timeout(isolation):
    settings = settings_for(isolation, slow_to_print, calculator, timeout=1.0)
    started = time.perf_counter()
    slow, quick = run_calls([call("slow_to_print", text=""), call("calculator", expression="1+1")], settings)
    assert time.perf_counter() - started < 5
    assert (slow.failure, quick.failure, quick.output) == ("timeout", None, "2")


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_an_exception_whose_message_raises_is_a_failed_call(isolation):
    (result,) = run_calls([call("raises_unprintable", text="")], settings_for(isolation, raises_unprintable))
    assert result.failure == "error"
    assert result.output == "error: MessageRaises: <the exception's message could not be shown>"


def test_process_isolation_gives_the_threads_answers():
    calls = [call("calculator", expression=e) for e in ("745 * 48", "1 / 3", "2 ** 1000", "x")]
    threaded = run_calls(calls, settings_for("thread", calculator))
    in_process = run_calls(calls, settings_for("process", calculator))
    assert [(r.output, r.failure) for r in threaded] == [(r.output, r.failure) for r in in_process]
    assert in_process[0].output == "35760" and in_process[3].failure == "error"


def test_a_spinning_tool_is_killed_at_its_timeout_in_process_mode():
    settings = settings_for("process", spin, calculator, timeout=0.5)
    started = time.perf_counter()
    spun, answered = run_calls([call("spin", text=""), call("calculator", expression="2+3")], settings)
    assert time.perf_counter() - started < 3
    assert (spun.failure, answered.output) == ("timeout", "5")
    assert "stopped" in spun.output
    assert not [t for t in threading.enumerate() if t.name == "forge-tool-spin"]  # nothing left spinning here
    assert len(settings.workers.idle) == 1  # the spinning worker was killed, the other kept
    (again,) = run_calls([call("calculator", expression="7*6")], settings)  # a new worker takes over
    assert again.output == "42"


def test_a_tool_that_allocates_without_end_fails_its_call_in_process_mode():
    settings = settings_for("process", hog, calculator, timeout=60, memory_mb=200)
    hogged, small = run_calls([call("hog", megabytes=100_000), call("hog", megabytes=20)], settings)
    assert hogged.failure == "error" and "MemoryError" in hogged.output
    assert (small.failure, small.output) == (None, "20")


def test_a_tool_that_ends_its_worker_fails_its_call_and_the_next_call_works():
    settings = settings_for("process", exits, calculator)
    (ended,) = run_calls([call("exits", text="")], settings)
    assert ended.failure == "error" and "exit status 3" in ended.output
    (after,) = run_calls([call("calculator", expression="2*2")], settings)
    assert after.output == "4"


def test_what_a_tool_prints_does_not_become_its_result():
    (result,) = run_calls([call("chatty", text="hi")], settings_for("process", chatty))
    assert (result.failure, result.output) == (None, "HI")


def test_tools_that_another_process_cannot_load_are_refused_with_what_to_do():
    def inner(text: str) -> str:
        """A closure.

        Args:
            text: ignored
        """
        return text

    inner_tool = as_tools([inner])
    with pytest.raises(ValueError, match="cannot run in a worker process.*inside another function.*tool_isolation="
                                         "'thread'"):
        ToolSettings(inner_tool, isolation="process")
    assert ToolSettings(inner_tool, isolation="thread").workers is None  # threads take anything
    with pytest.raises(ValueError, match="tool_isolation must be 'thread' or 'process'"):
        ToolSettings(inner_tool, isolation="fork")


def test_a_partial_and_a_tool_from_a_file_run_in_workers(tmp_path):
    path = tmp_path / "my_file_tools.py"
    path.write_text('def shout(text: str) -> str:\n    """Upper case.\n\n    Args:\n        text: words\n    """\n'
                    '    return text.upper()\n')
    (shout,) = load_tools(f"{path}:shout")
    scaled = functools.partial(hog)
    scaled.__name__, scaled.__doc__ = "hog", hog.__doc__
    settings = settings_for("process", shout, timeout=30)
    settings.workers.check()
    assert run_calls([call("shout", text="hi")], settings)[0].output == "HI"
    assert ToolWorkers({"hog": scaled}, 256).setup["tools"]["hog"]["kind"] == "pickle"


def test_the_config_field_is_checked_and_reaches_the_settings(tiny_tokenizer):
    with pytest.raises(ValueError, match="tool_isolation must be 'thread' or 'process'"):
        GRPOConfig(tool_isolation="fork").validate()
    with pytest.raises(ValueError, match="tool_memory_mb must be >= 64"):
        GRPOConfig(tool_memory_mb=0).validate()
    settings = ToolSettings.of_run([calculator], GRPOConfig(tool_isolation="process", tool_memory_mb=300),
                                   tiny_tokenizer)
    assert settings.isolation == "process" and settings.workers.memory_mb == 300
    assert len(settings.workers.idle) == 1  # started and checked when the run is set up
    settings.workers.close()
    assert ToolSettings.of_run([calculator], GRPOConfig(), tiny_tokenizer).workers is None  # 'thread' by default


def test_workers_end_with_their_pool():
    settings = settings_for("process", calculator)
    run_calls([call("calculator", expression="1")], settings)
    (worker,) = settings.workers.idle
    settings.workers.close()
    assert worker.process.poll() is not None


SCRIPT = '''
import sys
sys.path[:0] = {path!r}
from forge.tools.calls import ToolCall, ToolSettings, as_tools, run_calls

def shout(text: str) -> str:
    """Upper case.

    Args:
        text: words
    """
    return text.upper()

{guard}
    settings = ToolSettings(as_tools([shout]), isolation="process")
    print(run_calls([ToolCall("", "shout", {{"text": "hi"}})], settings)[0].output)
'''


@pytest.mark.parametrize("guarded", [True, False])
def test_a_tool_in_the_script_you_run_needs_its_main_guard(tmp_path, guarded):
    script = tmp_path / "train_with_tools.py"
    guard = 'if __name__ == "__main__":' if guarded else "if True:"
    script.write_text(SCRIPT.format(path=sys.path, guard=guard))
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120)
    if guarded:  # the worker runs the script as __mp_main__: the tool is there, the training code is not run
        assert done.returncode == 0 and done.stdout.strip() == "HI", done.stderr
    else:  # the worker would start workers of its own, and so on: the call fails, saying what to do
        assert 'put that code under `if __name__ == "__main__":`' in done.stdout, (done.stdout, done.stderr)
