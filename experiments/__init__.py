"""rlfleet's research experiments (`rlfleet_experiments`, its own distribution: experiments/pyproject.toml).

They depend on the product one way: they import rlfleet, and nothing in rlfleet imports them (an
import-linter contract in the repository's pyproject.toml). The images do not install them. What is here
and how to run it: experiments/README.md."""
