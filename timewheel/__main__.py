"""`python -m timewheel` runs the CLI."""
from timewheel.app.cli import main

main()
