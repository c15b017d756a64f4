"""Process groups of the parallel workers, the broadcast channel, and the
engine group's control channel. Nothing is imported here: the control
channel and the stop event are torch-free (a simulated pod imports them),
the process groups are not (import engine_pod.distributed.parallel_state)."""
