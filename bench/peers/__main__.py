"""`python -m bench.peers`: see bench/peers/__init__.py."""
from bench.peers.cli import main

main()
