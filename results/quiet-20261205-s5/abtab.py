import re,glob,sys,collections
d=sys.argv[1]
rows=collections.defaultdict(dict)
for f in sorted(glob.glob(d+'/*.md')):
    name=f.split('/')[-1][:-3]
    op=None
    for line in open(f):
        if line.startswith('## allreduce'): op='allreduce'
        elif line.startswith('## broadcast'): op='broadcast'
        m=re.match(r'\|\s*([\d.]+ [KMG]?i?B)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|',line)
        if m and op: rows[(op,m.group(1))][name]=(float(m.group(2)),float(m.group(3)))
for shm in ['', 'noshm-']:
  print('## shm' if not shm else '## LOCKSTEP_SHM=0')
  print('| op | size | before lockstep/raw (3 runs) | after lockstep/raw (3 runs) | before lockstep us (median) | after lockstep us (median) |')
  for (op,size),v in rows.items():
    def r(w): return [v[f'{w}-{shm}{i}'][1]/v[f'{w}-{shm}{i}'][0] for i in (1,2,3) if f'{w}-{shm}{i}' in v]
    def l(w): 
        x=sorted(v[f'{w}-{shm}{i}'][1] for i in (1,2,3) if f'{w}-{shm}{i}' in v); return x[len(x)//2] if x else float('nan')
    print(f"| {op} | {size} | {' '.join('%.3f'%x for x in r('before'))} | {' '.join('%.3f'%x for x in r('after'))} | {l('before'):.2f} | {l('after'):.2f} |")
