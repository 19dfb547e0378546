"""DecorateLM-style data engineering (Zhao et al., EMNLP 2024): rate texts by pairwise
comparisons (Bradley-Terry), tag them on a 3-level topic tree, edit them; distil one small
multi-task student from a teacher's annotations, decorate a corpus with it and select training
data by rating and tag balance.

Modules: corpus (offline text sources, readers), rating, tagging, editing, teacher, student,
decorate (streamed table writing), selection.
"""
