// DOM helpers. Everything is built with createElement + textContent: nothing from the
// gateway, a client or a model is ever parsed as HTML (there is no innerHTML anywhere).

/** h("tag#id.class", {attr: value, onclick: fn}, child, ...) -> Element. Strings become text nodes. */
export function h(spec, attrs, ...children) {
  const [tag, ...parts] = spec.split(/(?=[.#])/);
  const el = document.createElement(tag.startsWith(".") || tag.startsWith("#") ? "div" : tag);
  for (const part of tag.startsWith(".") || tag.startsWith("#") ? [tag, ...parts] : parts) {
    if (part[0] === "#") el.id = part.slice(1);
    else el.classList.add(part.slice(1));
  }
  if (attrs) {
    for (const [key, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (key.startsWith("on") && typeof value === "function") {
        el.addEventListener(key.slice(2), value);
      } else if (key === "class") {
        el.className += (el.className ? " " : "") + value;
      } else if (key === "dataset") {
        Object.assign(el.dataset, value);
      } else if (key === "value" || key === "checked" || key === "disabled") {
        el[key] = value;
      } else {
        el.setAttribute(key, value === true ? "" : String(value));
      }
    }
  }
  append(el, children);
  return el;
}

export function append(el, ...children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Replace every child of el. */
export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

export function fmtNumber(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function fmtMs(value) {
  if (value === null || value === undefined) return "–";
  return value >= 1000 ? `${fmtNumber(value / 1000, 2)} s` : `${fmtNumber(value, value < 10 ? 1 : 0)} ms`;
}

export function fmtPercent(value) {
  if (value === null || value === undefined) return "–";
  return `${fmtNumber(value * 100, 1)} %`;
}

export function fmtTime(seconds) {
  if (!seconds) return "–";
  const d = new Date(seconds * 1000);
  return d.toLocaleString(undefined, { year: "numeric", month: "2-digit", day: "2-digit",
                                       hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

export function fmtBytes(value) {
  if (value === null || value === undefined) return "–";
  if (value === 0) return "0";
  const units = ["B", "KiB", "MiB", "GiB"];
  let v = value;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${fmtNumber(v, i ? 1 : 0)} ${units[i]}`;
}

/** A status line element whose text and tone can be set (role=status for screen readers). */
export function notice() {
  const el = h("div.notice", { role: "status", hidden: true });
  el.show = (text, tone = "info", ...extra) => {
    el.className = `notice ${tone}`;
    replace(el, text, ...extra);
    el.hidden = false;
  };
  el.clear = () => { el.hidden = true; el.replaceChildren(); };
  return el;
}
