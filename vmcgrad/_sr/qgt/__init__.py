"""The QGT wing: the quantum geometric tensor S as a matrix-free operator, its products and solves."""
