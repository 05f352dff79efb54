"""SIGINT and SIGTERM stop a command alike: what a command saves on Ctrl-C it saves on SIGTERM (training, data
writing, bench, calibrate), with one line and the exit status 128 + the signal."""

from __future__ import annotations

import signal

import pytest
import typer
from typer.testing import CliRunner

from viasd.cli import user_errors
from viasd.stopping import Stopped, deferred_stop, stop_signals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_command_saves_its_work_on_sigterm_as_on_ctrl_c(sig):
    saved = []

    def command() -> None:
        try:
            signal.raise_signal(sig)
            pytest.fail("the signal did not stop the command")
        finally:
            saved.append(sig)  # what a command saves on its way out (bench: its report; calibrate: its work file)

    app = typer.Typer()
    app.command()(user_errors(command))
    result = CliRunner().invoke(app, [])
    assert saved == [sig] and result.exit_code == 128 + sig
    assert result.output.strip() == ("interrupted" if sig == signal.SIGINT else "stopped by SIGTERM")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are the process's again


def test_a_deferred_stop_lets_the_step_finish_and_a_second_signal_stops_at_once():
    with deferred_stop() as stop:
        assert not stop
        signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.name == "SIGTERM"  # asked; the loop saves and ends
        with pytest.raises(Stopped) as second:
            signal.raise_signal(signal.SIGINT)
    assert second.value.signum == signal.SIGINT and isinstance(second.value, KeyboardInterrupt)
    with stop_signals(), deferred_stop(), pytest.raises(Stopped):  # nested: the inner handler, then the outer again
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
