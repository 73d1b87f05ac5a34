"""Figures as the paper prints them (appendix C, tables tab:P_vs_G_1, tab:P_vs_G_2 and
tab:int_P_vs_G_3), keyed by group size G, for comparison with the exact values."""

AVERAGE_ABOVE_0_025 = {2: 0.999997499987, 4: 0.999995948256, 6: 0.827761785622, 8: 0.781129955681}
"""P(G, 0, 0.25)."""

AVERAGE_ABOVE_0_05 = {2: 0.999994999975, 4: 0.776965795853, 6: 0.689721502158, 8: 0.640944744224}
"""P(G, 0, 0.5)."""

COROLLARY2_AVERAGE = {
    2: 0.499997499987,
    3: 0.749995833315,
    4: 0.776965795853,
    5: 0.780787089465,
    6: 0.781154327380,
}
"""(G/2) * integral over (0, 2/G) of P(p_hat > p | S) dp."""
