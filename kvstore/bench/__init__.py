"""kvstore-bench: kvstore measured beside the raw socket limit and Redis, in one run."""
