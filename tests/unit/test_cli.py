import pytest

from weight_sync.tools.cli import main


@pytest.mark.parametrize(
    "argv", [["--help"], ["demo", "--help"], ["bench", "--help"], ["job", "--help"]]
)
def test_every_command_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: weight-sync" in out and ("--workers" in out or "demo" in out)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["demo", "--workers", "0"],
        ["frobnicate"],
        ["job", "--size-mb", "nan"],
        ["job", "--gpus", "maybe"],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_bench_refuses_an_unknown_device() -> None:
    from weight_sync.tools.bench.harness import run_bench

    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        run_bench(workloads=[], device="tpu")


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    from weight_sync import __version__
    from weight_sync.tools.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert (
        exited.value.code == 0 and capsys.readouterr().out.strip() == f"weight-sync {__version__}"
    )
