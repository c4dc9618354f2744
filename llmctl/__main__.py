"""`python -m llmctl` and the `llmctl` console script (pyproject.toml [project.scripts])."""
import sys


def run():
    """llmctl.cli.main, with Ctrl-C while the CLI's modules load (typer, rich: about half a
    second) ending like any other interrupt: one line and exit 130, not an import traceback."""
    try:
        from llmctl.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted: nothing was written.\n")
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
