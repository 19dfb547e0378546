"""DecorateLM-style data engineering (Zhao et al., EMNLP 2024): rate texts by pairwise
comparisons (Bradley-Terry), tag them on a 3-level topic tree, edit them; distil one small
multi-task student from a teacher's annotations, decorate a corpus with it and select training
data by rating and tag balance.

Modules: corpus (offline text sources, readers), rating, tagging, editing, teacher, student,
system (the student as a ``jaxflow.system.System``), decorate (streamed table writing),
selection, mixture (the experiment's corpus: pool, held-out and probe sets), lm_arms (one LM
per selection arm and seed).
"""

from jaxflow.decorate.corpus import Document, ReadStats, TemplateGenerator, read_jsonl, read_text_dir, write_jsonl
from jaxflow.decorate.decorate import DecorationStats, DecorationTableError, decorate_corpus, open_table, read_table
from jaxflow.decorate.editing import apply_ops, levenshtein, ops_from_edit
from jaxflow.decorate.lm_arms import ARMS, ArmInputs, LMRunner, arm_table, run_arms
from jaxflow.decorate.mixture import build_corpus
from jaxflow.decorate.rating import CRITERIA, comparisons_from_records, fit_bradley_terry, sample_pairs
from jaxflow.decorate.selection import combined_weights, rating_weights, select_budget, tag_balance_weights
from jaxflow.decorate.student import DecorateStudent, distill, init_student, make_predict
from jaxflow.decorate.system import DecorateStudentState, DecorateStudentSystem, StudentBatches, StudentHeldout
from jaxflow.decorate.tagging import TagHierarchy, default_hierarchy, hierarchical_decode
from jaxflow.decorate.teacher import Annotator, CallableAnnotator, LabelFileAnnotator, ProgrammaticTeacher, annotate

__all__ = [
    "Document", "ReadStats", "TemplateGenerator", "read_jsonl", "read_text_dir", "write_jsonl",
    "CRITERIA", "comparisons_from_records", "fit_bradley_terry", "sample_pairs",
    "TagHierarchy", "default_hierarchy", "hierarchical_decode",
    "apply_ops", "levenshtein", "ops_from_edit",
    "Annotator", "CallableAnnotator", "LabelFileAnnotator", "ProgrammaticTeacher", "annotate",
    "DecorateStudent", "distill", "init_student", "make_predict",
    "DecorateStudentSystem", "DecorateStudentState", "StudentBatches", "StudentHeldout",
    "build_corpus", "ARMS", "ArmInputs", "LMRunner", "arm_table", "run_arms",
    "DecorationStats", "DecorationTableError", "decorate_corpus", "open_table", "read_table",
    "combined_weights", "rating_weights", "select_budget", "tag_balance_weights",
]
