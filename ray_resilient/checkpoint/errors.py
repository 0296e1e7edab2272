"""The base of the errors a restart cannot fix."""


class UnrecoverableRunError(RuntimeError):
    """A failure every restart of the run would repeat (the job or its storage must change first):
    the recommended ``RunConfig`` ends the run at the first one instead of spending ``max_failures``."""
