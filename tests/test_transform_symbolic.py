"""The exactness claim proved symbolically: (q diag(lam) H)(K diag(1/lam) H)^T == q K^T."""

import pytest
import sympy

from vecinfer_compile.quant.hadamard import hadamard_matrix


@pytest.mark.parametrize("d", [16])
def test_query_key_transform_is_exact_symbolically(d):
    lam = sympy.symbols(f"lam0:{d}", positive=True)
    q = sympy.Matrix(1, d, sympy.symbols(f"q0:{d}"))
    k = sympy.Matrix(2, d, sympy.symbols(f"k0:{2 * d}"))
    # H's entries are +-1/sqrt(d): rebuild it exactly from the float matrix's signs.
    signs = hadamard_matrix(d).sign().tolist()
    h = sympy.Matrix(signs) / sympy.sqrt(d)
    q_t = q * sympy.diag(*lam) * h
    k_t = k * sympy.diag(*[1 / l for l in lam]) * h
    diff = sympy.simplify(q_t * k_t.T - q * k.T)
    assert diff == sympy.zeros(1, 2)
