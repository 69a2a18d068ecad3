"""Calls a test counts without changing what they do."""


def recorded_calls(monkeypatch, owner, name: str) -> list:
    """A list that receives the positional arguments of every call of `owner.name` for the rest
    of the test; each call still runs the original and returns what it returns."""
    calls, original = [], getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls
