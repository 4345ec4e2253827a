"""The training core below workers/ and trainers/: optimizer, schedule, precision, one
optimizer step over micro-batches, and the bad-step guard (see `core`)."""
