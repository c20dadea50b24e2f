"""Runnable examples of pipework."""
