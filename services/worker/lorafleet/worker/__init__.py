"""The worker: connects to the scheduler, trains leased jobs in-process, checkpoints from memory."""
