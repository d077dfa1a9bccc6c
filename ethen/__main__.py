"""``python -m ethen`` is the same as the ``ethen`` command."""

from ethen.cli import main

if __name__ == "__main__":
    main()
