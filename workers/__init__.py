"""What the prefill and the decode actor share (``workers.base.EngineWorker``)."""
