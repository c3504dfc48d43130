// Markdown to HTML, safe by construction: every piece of the source is HTML-escaped before any tag is made, and
// the only tags made are the ones below (links only to http(s) and mailto). No raw HTML passes through.
// Covers what models write: fenced code (``` with a language; an open fence while streaming is code), headings,
// lists, quotes, rules, tables, paragraphs, inline code, bold, italic, strike, links.

const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const escape = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);

const KEYWORDS = new Set(("if else elif for while do return function def class import from export const let var " +
  "new try catch except finally raise throw async await yield with as in of is not and or lambda pass break " +
  "continue switch case default struct enum fn pub use mod impl match self this None True False null true false " +
  "undefined int float str bool void char long double static public private package type interface go func " +
  "select where insert update delete create table").split(" "));

// A small highlighter for any language: comments, strings, numbers, keywords (escaped text in, spans out).
export function highlight(code) {
  const re = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/|--[^\n]*)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d+(?:\.\d+)?\b)|([A-Za-z_][A-Za-z0-9_]*)/g;
  let out = "", last = 0, m;
  while ((m = re.exec(code)) !== null) {
    out += escape(code.slice(last, m.index));
    const [t] = m;
    if (m[1]) out += `<span class="hl-c">${escape(t)}</span>`;
    else if (m[2]) out += `<span class="hl-s">${escape(t)}</span>`;
    else if (m[3]) out += `<span class="hl-n">${t}</span>`;
    else out += KEYWORDS.has(t) ? `<span class="hl-k">${t}</span>` : t;
    last = m.index + t.length;
  }
  return out + escape(code.slice(last));
}

function inline(text) {
  const codes = [];
  let s = text.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return `\u0000${codes.length - 1}\u0000`; });
  s = escape(s);
  s = s.replace(/\[([^\]\n]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/g,
    (_, t, u) => `<a href="${u}" target="_blank" rel="noopener noreferrer">${t}</a>`);
  s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>").replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/~~([^~\n]+)~~/g, "<del>$1</del>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${escape(codes[+i])}</code>`);
}

function codeBlock(lang, code) {
  const l = (lang || "").toLowerCase().replace(/[^a-z0-9+#-]/g, "").slice(0, 20);
  return `<div class="code"><div class="code-head"><span>${l || "code"}</span>` +
    `<button class="copy small" type="button">Copy</button></div><pre><code>${highlight(code)}</code></pre></div>`;
}

const cells = (row) => row.replace(/^\s*\|/, "").replace(/\|\s*$/, "").split("|").map((c) => inline(c.trim()));

function blocks(text) {
  const lines = text.split("\n");
  let html = "", para = [], list = null;
  const flushPara = () => { if (para.length) { html += `<p>${para.map(inline).join("<br>")}</p>`; para = []; } };
  const flushList = () => { if (list) { html += `<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`; list = null; } };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    let m;
    if (!line.trim()) { flushPara(); flushList(); continue; }
    if ((m = line.match(/^(#{1,6})\s+(.*)$/))) { flushPara(); flushList(); const n = m[1].length; html += `<h${n}>${inline(m[2])}</h${n}>`; continue; }
    if (/^\s*([-*_])\s*\1\s*\1[\s\1]*$/.test(line)) { flushPara(); flushList(); html += "<hr>"; continue; }
    if ((m = line.match(/^\s*>\s?(.*)$/))) { flushPara(); flushList(); html += `<blockquote>${inline(m[1])}</blockquote>`; continue; }
    if (line.includes("|") && i + 1 < lines.length && /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/.test(lines[i + 1])) {
      flushPara(); flushList();
      let t = `<table><thead><tr>${cells(line).map((c) => `<th>${c}</th>`).join("")}</tr></thead><tbody>`;
      i += 2;
      while (i < lines.length && lines[i].includes("|")) { t += `<tr>${cells(lines[i]).map((c) => `<td>${c}</td>`).join("")}</tr>`; i++; }
      i--;
      html += t + "</tbody></table>";
      continue;
    }
    if ((m = line.match(/^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/))) {
      flushPara();
      const tag = m[1] ? "ul" : "ol";
      if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
      list.items.push(m[3]);
      continue;
    }
    if (list && /^\s+\S/.test(line)) { list.items[list.items.length - 1] += " " + line.trim(); continue; }
    flushList();
    para.push(line);
  }
  flushPara(); flushList();
  return html;
}

export function render(text) {
  let html = "", rest = text;
  for (;;) {
    const open = rest.match(/(^|\n)[ \t]*```([^\n`]*)\n/);
    if (!open) { html += blocks(rest); break; }
    html += blocks(rest.slice(0, open.index));
    const body = rest.slice(open.index + open[0].length);
    const close = body.match(/(^|\n)[ \t]*```[ \t]*(\n|$)/);
    if (!close) { html += codeBlock(open[2].trim(), body); break; }  // still streaming
    html += codeBlock(open[2].trim(), body.slice(0, close.index));
    rest = body.slice(close.index + close[0].length);
  }
  return html;
}
