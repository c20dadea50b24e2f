"""The report service: seed 000 made real (see README.md beside this file)."""
