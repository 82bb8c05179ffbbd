/* Polynomial 2^f on f in [-0.5, 0.5] (Cody–Waite: 2^x = 2^round(x) · 2^f), minimax for relative error.
 * Max relative error: degree 3 7.5e-5 (13.7 bits, enough for bf16), 4 2.6e-6 (18.6 bits, f16), 5 7.5e-8 (f32).
 * Evaluated in f32 (coefficients rounded to float, Horner) add up to 2 ulp (2^-22); measured over [-125, 8] by
 * tests/test_ukernel.c: 7.5e-5, 2.7e-6, 2.3e-7.
 * Coefficients fitted for attnforge (Lawson-weighted least squares); c[0] first. */
#ifndef AF_KERNEL_EXP2_POLY_H
#define AF_KERNEL_EXP2_POLY_H

#define AF_EXP2_D3_C0 9.999280696e-01f
#define AF_EXP2_D3_C1 6.932610307e-01f
#define AF_EXP2_D3_C2 2.426112107e-01f
#define AF_EXP2_D3_C3 5.517137654e-02f

#define AF_EXP2_D4_C0 9.999992612e-01f
#define AF_EXP2_D4_C1 6.931218100e-01f
#define AF_EXP2_D4_C2 2.402474546e-01f
#define AF_EXP2_D4_C3 5.591790116e-02f
#define AF_EXP2_D4_C4 9.570086469e-03f

#define AF_EXP2_D5_C0 1.000000072e+00f
#define AF_EXP2_D5_C1 6.931469670e-01f
#define AF_EXP2_D5_C2 2.402211962e-01f
#define AF_EXP2_D5_C3 5.550713321e-02f
#define AF_EXP2_D5_C4 9.675547327e-03f
#define AF_EXP2_D5_C5 1.327647269e-03f

/* Inputs below this give exactly 0: keeps 2^round(x) a normal float; the sum such a term joins is >= 2^-8. */
#define AF_EXP2_MIN_INPUT (-125.0f)

#endif
