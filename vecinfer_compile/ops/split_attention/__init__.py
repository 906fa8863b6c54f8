"""Attention split into a coded part and a full-precision part, each with its log-sum-exp, merged
by :mod:`.lse_merge`: a chunk entering a non-empty cache (:mod:`.chunk`) and the simulate path's
windowed attention (:mod:`.windowed`); :mod:`.flash` says when torch's flash/cuDNN kernels serve.
Which keys go where is the rule of :mod:`vecinfer_compile.window`."""
