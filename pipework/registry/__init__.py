"""The pipe register centre: names to pipes, names to chains."""
