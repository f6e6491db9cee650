"""The run_rl application: the command line, runs and resumes, the console, run directories, simulate, serve-trainer."""
