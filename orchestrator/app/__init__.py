"""The run_rl application: the command line, runs and resumes, the console, simulate, serve-trainer, export and
import-gguf; the run directories it writes and reads back are ``orchestrator.run_files``."""
