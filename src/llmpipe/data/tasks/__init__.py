"""Executable function tasks: a docstring to implement, a reference body and hidden tests (MBPP/HumanEval-shaped
records). :mod:`.families` generates them, seeded and offline; :mod:`.records` reads and checks a user's own;
:mod:`.mixing` adds them to the SFT and preference data beside the corpus's rows."""
