"""Tells whether a jinja chat template reads message content as a string or as a list of parts.

Templates of multimodal-era families (GLM-5.x, Qwen3.5+) loop over `message.content` and join
the parts themselves; older ones print it as a string. vLLM inspects the template the same way
and hands content over in the matching shape, so prompts only agree if we do too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' `{% generation %}` blocks (assistant masks); only the AST is needed."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=32)
def content_format(chat_template: str) -> ContentFormat:
    """`openai` when the template iterates over a message's content, else `string`.

    The rules are vLLM's: a loop over `message.content` (`message` being a loop variable over
    `messages` or a name bound from it), a loop inside a macro over a parameter that some call
    passes `message.content`, or a loop outside macros over a name `content`.
    """
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        root = environment.parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "string"
    message_names = _message_loop_names(root)

    def is_content_of_message(node: jinja2.nodes.Node) -> bool:
        node = _unwrapped(node)
        if isinstance(node, jinja2.nodes.Getattr):
            is_content = node.attr == "content"
        elif isinstance(node, jinja2.nodes.Getitem):
            is_content = isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
        else:
            return False
        return is_content and isinstance(node.node, jinja2.nodes.Name) and node.node.name in message_names

    macros = {macro.name: macro for macro in root.find_all(jinja2.nodes.Macro)}
    loops_in_macros: set[int] = set()
    for macro in macros.values():
        content_params = _macro_params_given(root, macro, is_content_of_message)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            iterated = _unwrapped(loop.iter)
            if isinstance(iterated, jinja2.nodes.Name) and iterated.name in content_params:
                return "openai"
    for loop in root.find_all(jinja2.nodes.For):
        if is_content_of_message(loop.iter):
            return "openai"
        iterated = loop.iter
        if isinstance(iterated, jinja2.nodes.Name) and iterated.name == "content" and id(loop) not in loops_in_macros:
            return "openai"
    return "string"


def _unwrapped(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    # `x | list`, `x is iterable` and `x[1:]` still stand for `x`.
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _names_for(node: jinja2.nodes.Node, names: set[str]) -> bool:
    node = _unwrapped(node)
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _message_loop_names(root: jinja2.nodes.Template) -> set[str]:
    # Names holding the message list (`messages`, `{% set loop_messages = messages[1:] %}`, ...),
    # followed to a fixed point, then the loop variables that walk them.
    lists = {"messages"}
    while True:
        bound = {assign.target.name for assign in root.find_all(jinja2.nodes.Assign)
                 if isinstance(assign.target, jinja2.nodes.Name) and _names_for(assign.node, lists)}
        if bound <= lists:
            break
        lists |= bound
    return {loop.target.name for loop in root.find_all(jinja2.nodes.For)
            if isinstance(loop.target, jinja2.nodes.Name) and _names_for(loop.iter, lists)}


def _macro_params_given(root: jinja2.nodes.Template, macro: jinja2.nodes.Macro,
                        is_content: Callable[[jinja2.nodes.Node], bool]) -> set[str]:
    # `{% macro visible_text(c) %}...{% for item in c %}` called as `visible_text(m.content)`.
    arg_names = [arg.name for arg in macro.args]
    given: set[str] = set()
    for call in root.find_all(jinja2.nodes.Call):
        if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
            given |= {arg_names[i] for i, arg in enumerate(call.args) if i < len(arg_names) and is_content(arg)}
            given |= {kwarg.key for kwarg in call.kwargs if kwarg.key in arg_names and is_content(kwarg.value)}
    return given
