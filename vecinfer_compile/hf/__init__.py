"""The transformers adapters: where VecInfer meets a Hugging Face model.

One module each: which layers hold codes (:mod:`.layer_kinds`), what VecInfer's attention supports
(:mod:`.attention_support`), the attention output projection (:mod:`.output_projection`), the
fingerprint of the calibrated weights (:mod:`.weight_fingerprint`), recording what attention
receives (:mod:`.recording`), the eager attention over a cache's codes (:mod:`.attention_over_codes`) and
its decode-step mask (:mod:`.decode_mask`), ``generate()``'s deferred stop check
(:mod:`.deferred_stop`), tensor parallelism (:mod:`.tensor_parallel`) and the keywords that
differ between the transformers versions supported (:mod:`.compat`).

Importing this package imports none of them (they load transformers' modeling code on use).
"""
