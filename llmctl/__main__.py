"""`python -m llmctl` and the `llmctl` console script (pyproject.toml [project.scripts])."""
import sys


def run():
    """llmctl.cli.main, with Ctrl-C while the CLI's modules load (typer, rich: about half a
    second) ending like any other interrupt: one line and exit 130, not an import traceback."""
    from llmctl import interrupt

    try:
        from llmctl.cli import main
    except KeyboardInterrupt:
        interrupt.say("nothing was written.")
        sys.exit(interrupt.EXIT_CODE)
    main()


if __name__ == "__main__":
    run()
