"""The trainer behind an RPC: ``run_rl serve-trainer`` (server), ``RemoteTrainerWorker`` (client), the wire layout."""
