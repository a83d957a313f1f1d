"""Every attribute of a stub module is a function that fails loudly when called (never at import time)."""


def missing(module: str, name: str):
    if name.startswith("__"):  # keep Python's protocol lookups (__path__, __file__, ...) working
        raise AttributeError(name)

    def op(*args, **kwargs):
        raise NotImplementedError(f"{module}.{name}: sgl_kernel is an import-only stub on this CPU host "
                                  "(see infra/sgl_kernel_stub); this model/backend needs the real kernel")

    op.__name__ = name
    return op
