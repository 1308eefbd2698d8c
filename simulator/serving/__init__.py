"""The MODEL of one SGLang 0.5.10 server: memory formula, scheduler and per-step cost.
Nothing here knows about simpy; the engine calls ``Scheduler.next_batch`` / ``complete``."""
