"""The types that cross parts: Request, SamplingParams, request outputs, SchedulerOutput and
ModelRunnerOutput. Everyone may import them; they import nothing of ours at run time, so no
part needs to import upward (the scheduler and the runner never import the engine package)."""
