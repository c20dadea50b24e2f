"""Jobs and the job pool, events and the event queue, the dispatcher and its worker pools."""
