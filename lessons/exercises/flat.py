"""Exercise flat (lesson 04): ZeRO's flat buffers -- lay parameters end to end, view them back, find
your pieces.

nanomega/flat.py:FlatGroup holds parameters of one dtype laid end to end in one 1-D buffer,
zero-padded to N S elements (S = ceil(n / N), N the data-parallel size), rank r owning [lo, hi) = [r
S, (r+1) S). Its attributes, set before any of these is called: offsets[i], sizes[i], shapes[i] of
parameter i; padded = N S; lo, hi; dtype, device. Write three of its methods (each takes `self`, a
FlatGroup) and the bucketing function:
    flatten(self, tensors, dtype=None)  the tensors (shaped like the parameters, or flat) end to end in a NEW
                                        zeroed buffer of `padded` elements (dtype: self.dtype unless given)
    views(self, flat)                   views of a padded flat buffer shaped like the parameters: no copy (the
                                        parameters become views of `full`, so an update of one is the other)
    pieces(self)                        yield (i, a, b): parameter i has elements [a, b) of the flat buffer in
                                        this rank's slice [lo, hi), for every parameter that meets it
    split_by_size(named_params, cap_bytes, alone=())
                                        consecutive (name, p) into buckets of one dtype and at most cap_bytes
                                        (a larger parameter gets a bucket of its own); a parameter in `alone`
                                        (compare with `is`) gets a bucket of its own
Replaces nanomega/flat.py:FlatGroup.flatten, .views, .pieces and nanomega/flat.py:split_by_size in
the tests (ZeRO stages 0-3 at two ranks, bitwise equal to one process).
Grade:  python lessons/check.py --exercise flat lessons/exercises/flat.py
"""


def flatten(self, tensors, dtype=None):
    raise NotImplementedError("exercise flat: write flatten")


def views(self, flat):
    raise NotImplementedError("exercise flat: write views")


def pieces(self):
    raise NotImplementedError("exercise flat: write pieces")


def split_by_size(named_params, cap_bytes, alone=()):
    raise NotImplementedError("exercise flat: write split_by_size")
