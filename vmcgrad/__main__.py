"""``python -m vmcgrad``: the same as the ``vmcgrad`` console script."""

if __name__ == "__main__":
    import sys

    from .cli import main

    sys.exit(main())
