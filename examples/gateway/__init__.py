"""The demo gateway that `make run` starts: backends, a gateway file, and a launcher."""
