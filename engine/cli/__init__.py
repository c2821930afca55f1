"""The `refold` command (`refold.cli.main:main`; `python -m refold.cli`): produce,
consume, run, status, and the local servers of `refold.dev`, imported only by the
commands that start them."""
