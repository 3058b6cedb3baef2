"""A run's progress display (testbed/report/progress.py): ``lines`` prints the start
and each tenth of the requests, flushed, and the final count where a run stops
between tenths; a mode that is not true, false or lines fails naming the key."""

from __future__ import annotations

import pytest

from testbed.errors import InputError
from testbed.report.progress import Progress


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_lines_prints_the_start_and_each_tenth(capsys):
    progress = Progress(100, "lines")
    for n in range(101):
        progress(n * 0.5, n)
    progress.close()
    lines = _lines(capsys)
    assert lines[0] == "0/100 requests finished, t=0.0s"
    assert lines[-1] == "100/100 requests finished, t=50.0s"
    assert [int(line.split("/")[0]) for line in lines] == list(range(0, 101, 10))


def test_lines_skips_tenths_passed_in_one_step_and_ends_with_a_stopped_runs_count(capsys):
    progress = Progress(1000, "lines")
    progress(0.0, 3)  # the first step: a line, whatever the count
    progress(1.0, 250)  # past two tenths at once: one line
    progress(2.0, 260)  # no new tenth
    progress(3.0, 333)  # stopped here
    progress.close()
    counts = [int(line.split("/")[0]) for line in _lines(capsys)]
    assert counts == [3, 250, 333]


def test_bar_and_off_print_no_lines_and_a_run_never_started_prints_none(capsys):
    for mode in (True, False):
        progress = Progress(10, mode)
        progress(0.0, 10)
        progress.close()
    Progress(10, "lines").close()
    assert capsys.readouterr().out == ""


def test_an_unknown_mode_names_the_key():
    with pytest.raises(InputError, match=r"progress: 'bars' is not one of true, false or lines"):
        Progress(10, "bars")
