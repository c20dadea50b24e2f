"""The export example (seed 001): orders streamed from SQLite to CSV files, as async jobs."""
