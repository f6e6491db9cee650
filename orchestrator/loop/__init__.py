"""The step loop: the program, its recorder, the trainer worker, completion watching, the trace, the weight sync."""
