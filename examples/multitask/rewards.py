"""The capitals task's verifier: the capital named, in as few words as possible."""


def correct(completion: str, capital: str) -> float:
    return 1.0 if capital.lower() in completion.lower() else 0.0


def brief(completion: str) -> float:
    words = len(completion.split())
    return 1.0 if 1 <= words <= 3 else 3.0 / max(words, 1) if words else 0.0
