"""`python -m medusa_decoding.cli`: the `medusa` command."""

from . import main

main()
