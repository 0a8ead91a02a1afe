"""`python -m timewheel` runs the CLI."""
from timewheel.cli import main

main()
