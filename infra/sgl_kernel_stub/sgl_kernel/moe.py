from sgl_kernel._stub import missing


def __getattr__(name: str):
    return missing(__name__, name)
