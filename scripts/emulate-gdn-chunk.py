#!/usr/bin/env python3
# gdn_chunk (kernels/ops.cu) emulated on the CPU index for index: its shared-memory strides,
# its lower-tile map of M and P, the forward substitution, V', O and the state update in f32,
# over 150 rows (chunks of 64, 64 and 22) from a state that is not zeros, against a float64
# per-row recurrence. A check of the kernel's algorithm and indices without a device (not of
# its barriers or of the device's arithmetic: the contract case gdn_chunk does that).
# Needs numpy (`pip install --target DIR numpy`, then PYTHONPATH=DIR). Prints the relative L2
# errors of two blocks' outputs and states; session 27 read 4.6e-7 / 1.9e-7 (tolerance of the
# contract case: 7.4e-5); with the kernel's plant (line `x=ss[a*VS+cl]*el` without `*el`) the
# state reads ~2.
import numpy as np
rng=np.random.default_rng(5)
L,D,CW,KS,VS,MS=64,128,32,129,33,65
def prep(nk,nv,t):
    q=rng.standard_normal((t,nk,D)); k=rng.standard_normal((t,nk,D))
    q/=np.sqrt((q**2).sum(-1,keepdims=True)+1e-6); q/=np.sqrt(D)
    k/=np.sqrt((k**2).sum(-1,keepdims=True)+1e-6)
    v=rng.standard_normal((t,nv,D))
    beta=1/(1+np.exp(-rng.standard_normal((t,nv))))
    xa=rng.standard_normal((t,nv))+rng.standard_normal(nv)*0.5
    gate=-np.exp(rng.standard_normal(nv)*0.5)*np.log1p(np.exp(xa))
    return q,k,v,beta,gate
def recur(q,k,v,beta,gate,S,nk,nv):
    t=q.shape[0]; o=np.zeros((t,nv,D)); S=S.copy()
    for r in range(t):
        for h in range(nv):
            kh=h//(nv//nk); a=np.exp(gate[r,h]); Sh=S[h]*a
            d=beta[r,h]*(v[r,h]-Sh.T@k[r,kh]); Sh=Sh+np.outer(k[r,kh],d); S[h]=Sh; o[r,h]=Sh.T@q[r,kh]
    return o,S
def tiles(tid):
    ib=0
    while ib<15 and (ib+1)*(ib+2)//2<=tid: ib+=1
    return ib, tid-ib*(ib+1)//2
T=[tiles(t) for t in range(136)]
assert sorted(T)==sorted((i,j) for i in range(16) for j in range(i+1))
def block(qf,kf,vf,bf,gf,Sg,h,c0,kh,t,f=np.float32):
    ss=np.zeros(D*VS,f); ks=np.zeros(L*KS,f); qs=np.zeros(L*KS,f); ws=np.zeros(L*KS,f); vs=np.zeros(L*VS,f)
    ms=np.full(L*MS,np.nan,f); ps=np.full(L*MS,np.nan,f)
    for i in range(D*CW): ss[(i>>5)*VS+(i&31)]=Sg[h][i>>5][c0+(i&31)]
    o=np.zeros((t,CW),f)
    for r0 in range(0,t,L):
        l=min(L,t-r0)
        ks[:]=0; qs[:]=0
        for r in range(l):
            ks[r*KS:r*KS+D]=kf[r0+r,kh]; qs[r*KS:r*KS+D]=qf[r0+r,kh]
        for r in range(L):
            vs[r*VS:r*VS+CW]=vf[r0+r,h,c0:c0+CW] if r<l else 0
        gc=np.zeros(L,f); bt=np.zeros(L,f)
        gc[:l]=gf[r0:r0+l,h]; bt[:l]=bf[r0:r0+l,h]
        gc=np.cumsum(gc,dtype=f)
        eg=np.exp(gc).astype(f); fl=np.exp(gc[l-1]-gc).astype(f)
        for (ib,jb) in T:
            for x in range(4):
                for y in range(4):
                    i,j=4*ib+x,4*jb+y
                    kk=f(np.dot(ks[i*KS:i*KS+D],ks[j*KS:j*KS+D])); qk=f(np.dot(qs[i*KS:i*KS+D],ks[j*KS:j*KS+D]))
                    inn=i<l and j<=i
                    d=f(np.exp(gc[i]-gc[j])) if inn else f(0)
                    ms[i*MS+j]=bt[i]*kk*d if (inn and j<i) else 0
                    ps[i*MS+j]=qk*d if inn else 0
        for tid in range(D+CW):
            isw=tid<D
            for i in range(l):
                if isw:
                    x=bt[i]*ks[i*KS+tid]*eg[i]
                    for j in range(i): x=f(x-ms[i*MS+j]*ws[j*KS+tid])
                    ws[i*KS+tid]=x
                else:
                    c=tid-D; x=bt[i]*vs[i*VS+c]
                    for j in range(i): x=f(x-ms[i*MS+j]*vs[j*VS+c])
                    vs[i*VS+c]=x
        for i in range(l):
            for cl in range(CW):
                x=f(np.dot(ws[i*KS:i*KS+D], ss[cl::VS][:D]))
                vs[i*VS+cl]-=x
        for i in range(l):
            for cl in range(CW):
                x=f(np.dot(qs[i*KS:i*KS+D], ss[cl::VS][:D])); y=x*eg[i]
                for j in range(i+1): y=f(y+ps[i*MS+j]*vs[j*VS+cl])
                o[r0+i,cl]=y
        for j in range(l): ws[j*KS:j*KS+D]=ks[j*KS:j*KS+D]*fl[j]
        el=eg[l-1]
        for a in range(D):
            for cl in range(CW):
                x=ss[a*VS+cl]*el
                for j in range(l): x=f(x+ws[j*KS+a]*vs[j*VS+cl])
                ss[a*VS+cl]=x
    Sout=np.array([[ss[a*VS+c] for c in range(CW)] for a in range(D)])
    return o,Sout
nk,nv,t=1,2,150
q,k,v,beta,gate=prep(nk,nv,t)
S0=rng.standard_normal((nv,D,D))*0.1
o_ref,S_ref=recur(q,k,v,beta,gate,S0,nk,nv)
h=1; kh=h//(nv//nk)
for c0 in (0,96):
    o,S=block(q,k,v,beta,gate,S0,h,c0,kh,t)
    eo=np.linalg.norm(o-o_ref[:,h,c0:c0+CW])/np.linalg.norm(o_ref[:,h,c0:c0+CW])
    es=np.linalg.norm(S-S_ref[h][:,c0:c0+CW])/np.linalg.norm(S_ref[h][:,c0:c0+CW])
    print(f"c0 {c0}: rel L2 o {eo:.2e}, S {es:.2e}")
