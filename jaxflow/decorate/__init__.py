"""DecorateLM-style data engineering (Zhao et al., EMNLP 2024): rate texts by pairwise
comparisons (Bradley-Terry), tag them on a 3-level topic tree, edit them; distil one small
multi-task student from a teacher's annotations, decorate a corpus with it and select training
data by rating and tag balance.

Modules: corpus (offline text sources, readers), rating, tagging, editing, teacher, student,
decorate (streamed table writing), selection.
"""

from jaxflow.decorate.corpus import Document, ReadStats, TemplateGenerator, read_jsonl, read_text_dir, write_jsonl
from jaxflow.decorate.decorate import DecorationStats, DecorationTableError, decorate_corpus, open_table, read_table
from jaxflow.decorate.editing import apply_ops, levenshtein, ops_from_edit
from jaxflow.decorate.rating import CRITERIA, comparisons_from_records, fit_bradley_terry, sample_pairs
from jaxflow.decorate.selection import combined_weights, rating_weights, select_budget, tag_balance_weights
from jaxflow.decorate.student import DecorateStudent, distill, init_student, make_predict
from jaxflow.decorate.tagging import TagHierarchy, default_hierarchy, hierarchical_decode
from jaxflow.decorate.teacher import Annotator, CallableAnnotator, LabelFileAnnotator, ProgrammaticTeacher, annotate

__all__ = [
    "Document", "ReadStats", "TemplateGenerator", "read_jsonl", "read_text_dir", "write_jsonl",
    "CRITERIA", "comparisons_from_records", "fit_bradley_terry", "sample_pairs",
    "TagHierarchy", "default_hierarchy", "hierarchical_decode",
    "apply_ops", "levenshtein", "ops_from_edit",
    "Annotator", "CallableAnnotator", "LabelFileAnnotator", "ProgrammaticTeacher", "annotate",
    "DecorateStudent", "distill", "init_student", "make_predict",
    "DecorationStats", "DecorationTableError", "decorate_corpus", "open_table", "read_table",
    "combined_weights", "rating_weights", "select_budget", "tag_balance_weights",
]
